"""The ledger: a training step's memory, FLOPs and time, predicted and measured; no Lightning.

Its folders, in the pipeline's order (docs/architecture.md): run.py describes a run; count/ holds the
instruments; dryrun/ runs one step of any model on fake tensors; closedform/ is the toy LM's formulas;
sharding/ is one rank's step at world size W; timing/ is where the seconds go; hardware/ is what a device
can do; predict.py is the front door and report.py the result. Modules are imported by name
(ledger.dryrun.engine, ledger.hardware.gpus, ...); the packages export nothing.
"""
