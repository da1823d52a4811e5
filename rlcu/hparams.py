"""What Lightning can save as a hyperparameter: plain values, not modules, callables or datasets."""
from __future__ import annotations


def plain(v) -> bool:
    if v is None or isinstance(v, (str, int, float, bool)):
        return True
    if isinstance(v, (list, tuple)):
        return all(plain(x) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and plain(x) for k, x in v.items())


def not_plain(**values) -> list[str]:
    """Names to pass to `save_hyperparameters(ignore=...)`."""
    return [name for name, v in values.items() if not plain(v)]
