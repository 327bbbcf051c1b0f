"""Shape annotations that cost nothing when jaxtyping is absent.

attnkit annotates public tensors as ``Float[Tensor, "*batch H Tq Dk"]``. jaxtyping is a test extra,
not a runtime dependency: without it the annotations below degrade to plain ``Tensor``. The test
suite installs jaxtyping's import hook so that every annotated signature is checked at runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxtyping import Bool, Float, Int
else:
    try:
        from jaxtyping import Bool, Float, Int
    except ImportError:  # pragma: no cover - exercised only without the test extras

        class _Untyped:
            def __class_getitem__(cls, item: Any) -> Any:
                return item[0]

        Bool = Float = Int = _Untyped

__all__ = ["Bool", "Float", "Int"]
