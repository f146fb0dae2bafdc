"""The command groups of ``hydra-diag``, one module each (thin: parse options, call the library)."""
