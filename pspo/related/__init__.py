"""The machinery of the methods pspo compares PSPO with: docs/related.md's SPO, segment math and rollouts
(spo_segments.py, spo.py, §B), and PSPO*'s process reward (process_reward.py, prm.py, §C); Single-stream PO's
value tracker (single_stream.py, docs/methods.md §10, beside PPS and ERS, whose prompt-level questions it
shares). REINFORCE++ (§A) is an advantage formula and lives beside the others in pspo/estimators.py, as
Single-stream PO's advantage does."""
