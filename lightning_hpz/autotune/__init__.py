"""Choosing the hpZ size and ZeRO-3 thresholds from link measurements (``HpzStrategy(autotune=True)``)."""
