"""The examples that ship with hetps and train offline, named from a config by module path
like a model or dataset of your own (docs/own-model.md, "The examples"):

- `hetps.examples.charlm`: a small decoder-only transformer, a byte-level language model
  of the Python documentation's text (`pydoc_data.topics`, part of every CPython);
  configs/charlm.yaml (`task: language_model`, a perplexity target).
- `hetps.examples.ctr`: click-through-rate prediction with a DLRM-style model (an
  embedding table per categorical field) on a synthetic click log with planted true click
  probabilities; configs/ctr.yaml (`task: binary`, an AUC target).
- `hetps.examples.autompg`: a regression of cars' fuel use (the UCI Auto MPG data that
  mlxtend ships); configs/regression.yaml (`task: regression`, an R² target).
- `hetps.examples.sines`: a task of your own end to end: a 1-D CNN on generated noisy
  sine waves, a macro-F1 Task (a confusion matrix from `eval_sums`) and an lr schedule
  factory; configs/sines.yaml (a macro-F1 target; docs/own-model.md walks through it).
"""
