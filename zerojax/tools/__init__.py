"""Tools around a training run: memory reports, estimators, compiled-step reports,
visualisation, step planning and autotuning. Nothing under ``zerojax.tools`` is on the
training path; every tool reads a plan, a state or a compiled step."""
