"""``hydra-diag race``: named model configurations trained for the same wall-clock budget on the same
tokens, compared by validation loss (see :mod:`hydra_diag.commands.race` for the rules)."""
