"""The tensor-parallel linears: the column/row-parallel modules and their autograd functions
(:mod:`.modules`, :mod:`.functions`), the shared-input pair (:mod:`.shared_input`), the rings of
``--tp-comm-overlap`` (:mod:`.collective_matmul`) and the one GEMM module they all call
(:mod:`.gemm`)."""
