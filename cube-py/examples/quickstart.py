"""Cube from Python in one screen: cells that keep state, files, snapshot, rollback,
clone. Run as root after `pip install` of the cubesandbox wheel:

    python quickstart.py
"""

from cubesandbox import Sandbox

with Sandbox.create() as sb:  # the built-in "host" template; killed when the block ends
    print("sandbox", sb.id, "on the", sb.engine, "engine")

    # A variable lives on from one cell to the next.
    sb.run_code("answer = 41")
    print("answer + 1 =", sb.run_code("answer + 1").text)

    # Files go in and come out.
    sb.files.write("/home/user/notes.txt", "written from Python\n")
    print("file says:", sb.files.read("/home/user/notes.txt").strip())

    # Snapshot, break things, roll back.
    snap = sb.create_snapshot()
    sb.run_code("answer = 'overwritten'")
    sb.files.write("/home/user/notes.txt", "overwritten\n")
    sb.rollback(snap)
    print("after rollback the file says:", sb.files.read("/home/user/notes.txt").strip())
    if snap.kind == "full":
        print("after rollback answer =", sb.run_code("answer").text)
    else:
        # A file-system snapshot holds files only: rollback restarts the interpreter.
        print("snapshot kind", snap.kind, "- the interpreter restarted, so answer is gone")

    # Clones start from the sandbox as it is now and go their own ways.
    clones = sb.clone(2)
    for i, clone in enumerate(clones):
        clone.files.write("/home/user/notes.txt", f"clone {i}\n")
    print("clones say:", [c.files.read("/home/user/notes.txt").strip() for c in clones])
    print("parent says:", sb.files.read("/home/user/notes.txt").strip())
    for clone in clones:
        clone.kill()
