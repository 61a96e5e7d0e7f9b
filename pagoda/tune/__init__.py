"""`pagoda tune`: the tuning path of a serving deployment, walked on the user's machine."""

from pagoda.tune.cli import add_tune_args

__all__ = ["add_tune_args"]
