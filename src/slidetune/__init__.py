"""slidetune: full-parameter fine-tuning on one small GPU by sliding layers through it."""
__version__ = "0.1.0"
