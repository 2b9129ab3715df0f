"""Differentiable collectives, sequence reorders, redistribution plans and the record of what each moved."""
