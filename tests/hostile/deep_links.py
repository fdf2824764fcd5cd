# The worker's cost of the artifact walk: 250,000 hard links with long names under a
# ~3,845-byte directory path (15 levels of 255-byte names). Cheap for the job (hard links cost no inodes, ~70 MB of
# directory blocks); the worker's artifact walk once kept every path and grew by ~1.5 GB.
# Right: the job succeeds, the walk stays bounded in the worker's memory and CPU, and every
# skipped file is counted.
import os
os.chdir("/work")
# And a flat directory of 260,000 hard links with 200-byte names, past the walk's
# 250,000-entry cap.
for i in range(260000):
    src = "flat_src%d" % (i // 50000)  # ext4 allows 65,000 links to one inode
    if i % 50000 == 0:
        open(src, "w").close()
    os.link(src, "f" * 193 + "%06d" % i)
for i in range(15):
    d = ("D%02d" % i) + "d" * 252
    os.mkdir(d)
    os.chdir(d)
name = "n" * 128
for s in range(4):
    open("src%d" % s, "w").close()
    for i in range(62400):
        os.link("src%d" % s, "%s%06d_%d" % (name, i, s))
print("made", 260006 + 4 * 62401, "entries")
