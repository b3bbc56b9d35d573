"""Which layers train: surgical fine-tuning's criteria and fixed choices, LIFT and LISA, and L-MSA's Method of
Successive Approximations with its settings."""
