"""What a run evaluates beside its held-out loss: greedy samples of chosen prompts at each evaluation
(samples.py) and lm-evaluation-harness tasks on a saved model (harness.py, `slidetune eval`)."""
