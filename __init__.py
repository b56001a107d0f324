"""pdserve: disaggregated prefill/decode LLM serving.

The repository root is the `pdserve` import package; each top-level folder is a subpackage.
"""

__version__ = "0.1.0"
