"""deltalab: delta-rule linear attention with uncertainty-aware and sensitivity-gated memories.

`import deltalab` alone loads neither torch nor transformers (every `deltalab` command imports
it for its parser), so it does not register the models with transformers' Auto classes: a
transformers config class imports torch. Importing `deltalab.models` (which
`from deltalab.models import CausalLM` and reading the attribute `deltalab.models` do) registers
them, so that `AutoModelForCausalLM.from_pretrained(path)` then loads a deltalab checkpoint. The
subpackages are attributes of the package, each imported when first read.
"""

from deltalab._lazy import lazy_attributes

__version__ = "0.1.0"

__getattr__ = lazy_attributes(
    __name__,
    {},
    submodules=("analysis", "data", "eval", "layers", "models", "ops", "study", "train"),
)
