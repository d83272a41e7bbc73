"""Prints "yes" when pip may not install into the Python running this, else "no".

PEP 668: a distribution marks its interpreter with an EXTERNALLY-MANAGED file in the
standard library's directory, and pip then refuses to install outside a virtual
environment (Debian 12's /usr/bin/python3 is marked). Inside a virtual environment the
marker does not apply. Standard library only: setup.sh runs it before anything is installed.
"""

import os
import sys
import sysconfig


def externally_managed() -> bool:
    if sys.prefix != sys.base_prefix:  # a virtual environment
        return False
    stdlib = sysconfig.get_path("stdlib")
    return bool(stdlib) and os.path.isfile(os.path.join(stdlib, "EXTERNALLY-MANAGED"))


if __name__ == "__main__":
    print("yes" if externally_managed() else "no")
