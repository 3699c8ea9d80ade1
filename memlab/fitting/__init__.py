"""Will it fit: any Hugging Face config run for one step on the virtual GPU (`plan`: the options, `fit` and
its result; `model`: the model built on meta and the step; `run`: measuring it, extended from 1-3 layers,
ZeRO sharding and the cost; `layers`: models whose layers differ; `optimizers`: the optimizer as run; `config`:
the model read and checked), the largest sequence or batch that fits (`limits`), the cheapest plans that fit and
the `memlab-fit` command (`search`).

transformers and peft load inside the functions, so importing this costs no more than torch."""
from .limits import FitMax, fit_max
from .plan import FitResult, fit, fit_presets
from .search import fit_search

__all__ = ["FitMax", "FitResult", "fit", "fit_max", "fit_presets", "fit_search"]
