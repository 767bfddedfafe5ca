"""The demo model's own code: the synthetic world it answers questions about (`world`), the token layout
and batches it is trained on (`data`, `batch`), its tokenizer and architecture (`tokenizer`, `config`) and
its training run (`python -m raincheck_demo.train`).

Its trained checkpoints are the repository's `models/demo-v2` (v2; the name "demo" in
raincheck_core/models/shipped.py) and `models/demo` (v1, "demo-v1"), each with its model card. The engine
library (`raincheck_core`) loads them like any Hugging Face folder and never imports this package; this
package uses the engine's chat formatting, positions and vision settings, so that it trains on exactly the
layout the engine builds.
"""
