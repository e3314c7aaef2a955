"""The Triton python-backend side of the engine, kept free of `triton_python_backend_utils` so it runs in tests.

`model_repository/neo/1/model.py` owns the model's lifecycle and threads and turns what these modules return
into `pb_utils` objects.
"""
