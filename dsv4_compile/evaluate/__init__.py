"""Training-free evaluation of a DeepSeek V4 model on the compiled backend: what
``python -m dsv4_compile`` runs.

:mod:`.inputs` reads and checks the model and the corpus, :mod:`.run` runs a task on the runner
(warm-up, timed loops), :mod:`.eager` compares with ``transformers`` eager, :mod:`.evaluation`
puts them together, :mod:`.report` prints the summary and writes JSON.
"""

from .evaluation import Plan, evaluate
from .inputs import InputError

__all__ = ["InputError", "Plan", "evaluate"]
