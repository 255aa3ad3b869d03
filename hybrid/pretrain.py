"""``torchrun -m hybrid.pretrain`` / ``python -m hybrid.pretrain``: the pretraining job (see
:mod:`hybrid.job.pretrain`)."""

import os

from hybrid.job.pretrain import exit_now, main

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_now(main())
