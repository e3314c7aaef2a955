"""Serving through Triton: starting `tritonserver` on the model repository (`server.py`) and the parts of the
python-backend model that need no `triton_python_backend_utils`, so they run in tests.

`model_repository/neo/1/model.py` owns the model's lifecycle and threads and turns what these modules return
into `pb_utils` objects.
"""
