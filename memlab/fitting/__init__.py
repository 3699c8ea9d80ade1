"""Will it fit: any Hugging Face config run for one step on the virtual GPU (`plan`: the options, `fit` and
its result; `model`: the model built on meta and the step; `run`: measuring it, extended from 1-3 layers,
ZeRO sharding and the cost), the cheapest plans that fit and the `memlab-fit` command (`search`).

transformers and peft load inside the functions, so importing this costs no more than torch."""
from .plan import FitResult, fit, fit_presets
from .search import fit_search

__all__ = ["FitResult", "fit", "fit_presets", "fit_search"]
