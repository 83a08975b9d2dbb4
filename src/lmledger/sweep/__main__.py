"""The processes `lmledger sweep` starts.

    python -m lmledger.sweep point PARENT_PID LMLEDGER_ARGS...   one sweep point (launch.point_command)
    python -m lmledger.sweep slurm-task TASKS.json INDEX         one point as a SLURM array task (slurm.task_main)

Both run a command line through lmledger.cli.main.
"""

import sys

if __name__ == "__main__":
    from lmledger.cli import main  # an entry point, above the commands

    if sys.argv[1:2] == ["point"]:
        from lmledger.sweep.launch import point_main

        sys.exit(point_main(sys.argv[2:], main))
    if sys.argv[1:2] == ["slurm-task"] and len(sys.argv) == 4:
        from lmledger.sweep.slurmtask import task_main

        sys.exit(task_main(sys.argv[2:], main))
    sys.exit(
        "usage: python -m lmledger.sweep point PARENT_PID LMLEDGER_ARGS... | slurm-task TASKS.json INDEX "
        "(run by `lmledger sweep`)"
    )
