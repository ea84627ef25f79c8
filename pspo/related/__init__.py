"""The related methods of docs/related.md: SPO's segment math and rollouts (spo_segments.py, spo.py,
§B) and PSPO*'s process reward (process_reward.py, prm.py, §C). REINFORCE++ (§A) is an advantage
formula and lives beside the others in pspo/estimators.py."""
