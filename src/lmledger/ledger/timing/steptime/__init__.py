"""The predicted step time (docs/time.md): each op of the dry run replayed on this device, plus what a
replay cannot see (calibrate.py), cached per machine (cache.py). predict.predict_step_time is the entry point."""

from lmledger.ledger.timing.steptime.calibrate import DataWait, data_wait
from lmledger.ledger.timing.steptime.predict import CATEGORIES, NoStepTime, StepTime, predict_step_time

__all__ = ["CATEGORIES", "DataWait", "NoStepTime", "StepTime", "data_wait", "predict_step_time"]
