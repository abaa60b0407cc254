"""How the serving code reads a request's input tensors, whatever carries them (Triton's
`pb_utils` request in `adapter.getter`, a test's dict): `get(name)`, None where the request
sent no such input."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Getter = Callable[[str], "np.ndarray | None"]
