"""Drafters: one small class each behind ``base.Drafter``, all served by the one verify loop.

``lookup`` (n-gram), ``draft_model`` (a small model sharing the tokenizer), ``dspark``,
``dflash`` and ``dflash2`` (block drafters on the target's hidden states: ``block`` is their
backbone, ``checkpoint`` reads and writes their files), ``mtp`` and ``eagle3`` (chain heads on the
target's hidden states: ``chain`` keeps their rows and cache, ``formats`` reads their files),
``lookup_first`` (lookup's draft when the context repeats, a model drafter's otherwise). A drafter
gets what it needs passed in and never imports the engine above it."""
