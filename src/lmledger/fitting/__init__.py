"""How `lmledger fit|validate` builds and checks a run: a library below the commands.

    checks.py   refused before a run starts: config files, class paths, trainer values, a build failure
    resume.py   --ckpt_path: its form, `last`/`auto`, a checkpoint's class paths and hyperparameters,
                and whether it may resume this run (same settings and data, steps left)
    cli.py      FitCLI: LightningCLI with the ledger, atomic checkpoints, preemption, the run lock;
                parse_fit_config / build_model_and_data / first_batch for account, plan and sweeps
    steps.py    checks on the first real step (StepChecks); naming the event file on a full disk

The thin command over them is commands/fit.py.
"""
