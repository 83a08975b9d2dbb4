"""How `lmledger fit|validate` builds and checks a run: a library below the commands.

    checks.py   everything refused before a run starts: config files, class paths, a checkpoint's own class
                paths and hyperparameters, --ckpt_path's form and `last`/`auto` resolution, trainer values
    cli.py      LedgerCLI (LightningCLI with the ledger, atomic checkpoints, preemption and the run lock),
                parse_fit_config / build_model_and_data / first_batch for account, plan and sweeps
    steps.py    the checks made on the first real step (StepChecks) and the event-file naming on a full disk

commands/train.py is the thin command over them.
"""
