"""System prompts a config may name (`data.system_prompt`): name -> text. Plain data, no imports, so
that config.py (which validates the name) and data.py (which formats prompts) share one table."""

# The R1 prompt of the open-rs / Open-R1 recipes: reason in <think> </think>, answer in \boxed{}.
# Departure from the recipes' text: they also ask for <answer> </answer> tags (and print a literal
# "\boxed{{}}"); our format reward (docs/methods.md §5) wants <think>..</think> then \boxed{...}.
R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process is enclosed within <think> </think>, followed by the final answer "
    "in \\boxed{}, i.e., <think> reasoning process here </think> The answer is \\boxed{answer here}."
)
SYSTEM_PROMPTS = {"r1": R1_SYSTEM_PROMPT}     # data.system_prompt names; any other value is the text itself
