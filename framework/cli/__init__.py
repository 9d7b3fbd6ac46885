"""Entry points: each command's code (``python -m framework.X`` runs ``framework/X.py``, which calls
``framework.cli.X.main``), the training loop and launcher they run, and the GPU-bug mutations the
checking accelerator is tested against."""
