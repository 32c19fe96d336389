"""Training, offline: the delayed tree's neural selector and tree-aware draft adapters.

  talf.py             TALF: the tree-aware draft loss and LoRA adapters for a draft
  selector_train.py   the selector's training targets and objective

May import: strategies, verification rules and the core; models load adapters from here (contract `engine-rooms`).
"""
