"""engine/ is the lower layer: the core drives the model through the Executor interface and
imports nothing from workers/ or frontend/; the offline LLM and the decoder process both
build EngineCore around the same in-process executor."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def test_engine_imports_nothing_from_workers_or_frontend():
    offenders = [f"{path.name}:{line} imports {module}"
                 for path in sorted((REPO / "engine").glob("*.py"))
                 for line, module in imported_modules(path)
                 if module.split(".")[0] in ("workers", "frontend")]
    assert offenders == []


def test_offline_llm_and_decoder_process_use_the_same_executor():
    from engine.llm import default_executor_factory
    from workers.inprocess_executor import InProcessExecutor

    assert default_executor_factory() is InProcessExecutor
    decoder_imports = {module for _, module in imported_modules(REPO / "workers" / "decoder_process.py")}
    assert "workers.inprocess_executor" in decoder_imports
