"""The linearized model of ``seeds/001_*.txt``: the empirical NTK and its selection, the selective proximal
step, and the anchor ``theta_0`` both start from."""
