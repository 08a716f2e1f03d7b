"""Built-in ops, one module each. A module exports ``SPEC`` (an OpSpec) and ``VARIANTS``."""
