"""Opt-in rank allocation studies (``--allocation measured|sensitivity``): kept for study, measured
no better than the shared rank out of domain after training (their docstrings give the figures)."""
