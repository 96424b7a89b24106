"""How the trained weights move: optimizers, learning-rate schedules, the EMA of the weights, fused backward."""
