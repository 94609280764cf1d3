"""deltalab: delta-rule linear attention with uncertainty-aware and sensitivity-gated memories.

Importing the package registers its models with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(path)` loads a deltalab checkpoint.
"""

__version__ = "0.1.0"

from deltalab import models  # noqa: F401  (registers model_type "deltalab")
