"""argparse whose usage errors are UserErrors: one line on stderr, exit 2, like every other bad input."""

from __future__ import annotations

import argparse

from lmledger.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")
