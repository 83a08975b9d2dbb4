"""`python -m examples.fit fit|validate ...` is `lmledger fit|validate ...`, which trains any LightningModule.

    lmledger fit --config configs/examples/hf-llama.yaml [--trainer.max_steps 50 ...]
    lmledger fit --model examples.byte_convnet.ByteConvNet [--data CLASS_PATH] [...]

lmledger's CLI switches to LightningCLI's subclass mode when the config or command line names a class
(docs/any-model.md, "From the command line"); this module stays so older command lines keep working.
"""

from __future__ import annotations

import sys

from lmledger.cli import main as lmledger


def main(args: list[str] | None = None) -> int:
    return lmledger(list(sys.argv[1:] if args is None else args))


if __name__ == "__main__":
    sys.exit(main())
