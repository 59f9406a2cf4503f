"""Training objectives beside supervised fine-tuning's cross-entropy (issue 47): preference.py,
the preference losses (DPO, IPO, SimPO, ORPO) as functions of each sequence's log-probabilities."""
