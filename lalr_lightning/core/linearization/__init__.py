"""The linearized model of "Linearization Explains Fine-Tuning in Large Language Models" (https://arxiv.org/abs/2602.08239): the empirical NTK and its selection, the selective proximal
step, and the anchor ``theta_0`` both start from."""
