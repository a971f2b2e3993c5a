"""What rank 0 alone runs: the run around the steps (releasing prompts, checking and admitting
rollouts, evaluations, the ledger, accounting, tracking)."""
