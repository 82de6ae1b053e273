"""Training: the loop and the parts it conducts (data position, checkpoints, resume rules, parallel strategies, optimizers)."""
