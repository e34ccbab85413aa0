"""`graphsafe verify --pp N`: a trainer process and N pipeline-stage processes over gloo,
their settings, what they send each other, and how the parent starts and ends them."""
