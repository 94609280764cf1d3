"""deltalab: delta-rule linear attention with uncertainty-aware and sensitivity-gated memories.

Importing `deltalab.models` (which `from deltalab.models import CausalLM` does) registers the
models with transformers' Auto classes, so `AutoModelForCausalLM.from_pretrained(path)` loads a
deltalab checkpoint. `import deltalab` alone loads neither torch nor transformers.
"""

__version__ = "0.1.0"
