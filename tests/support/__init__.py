"""What the tests share: helpers, models, training bodies and the scripts the tests launch.

Test modules import from here (``from support.reference import train``), never from each other
(tests/project/test_suite_layout.py checks it); ``tests`` is on ``sys.path`` (pyproject.toml's
``[tool.pytest.ini_options] pythonpath``), and on the rank pool's, so a function from here runs on
the ranks too."""
