/* A peer for tests/fs/bench_workers.py: one file "n1" of RAM served by libfuse's low-level API
 * with T threads (T = 1: fuse_session_loop; T > 1: fuse_session_loop_mt, each thread on a cloned
 * /dev/fuse descriptor); writes land in the same RAM (libfuse 3.14 cannot ask for the kernel's
 * parallel direct writes, which ours asks for: the kernel takes the file's inode lock
 * exclusively for each of its direct writes, shared for ours).  It shows what more serving
 * threads buy on this host and kernel when the server is native code: the ceiling the FUSE
 * workers are measured against.  Not part of the product (which has no C on its command
 * path); the bench builds it with gcc at run time.
 *
 *   peer_fuse_ram MOUNTPOINT SIZE_MIB THREADS      (runs in the foreground until unmounted)
 */
#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char *data;
static size_t size;
static int threads;

static int attr_of(fuse_ino_t ino, struct stat *st) {
    memset(st, 0, sizeof(*st));
    st->st_ino = ino;
    if (ino == FUSE_ROOT_ID) {
        st->st_mode = S_IFDIR | 0755;
        st->st_nlink = 2;
    } else if (ino == 2) {
        st->st_mode = S_IFREG | 0600;
        st->st_nlink = 1;
        st->st_size = (off_t)size;
    } else {
        return ENOENT;
    }
    return 0;
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct stat st;
    (void)fi;
    if (attr_of(ino, &st))
        fuse_reply_err(req, ENOENT);
    else
        fuse_reply_attr(req, &st, 60.0);
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    struct fuse_entry_param e;
    memset(&e, 0, sizeof(e));
    if (parent != FUSE_ROOT_ID || strcmp(name, "n1") != 0) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    e.ino = 2;
    e.attr_timeout = e.entry_timeout = 60.0;
    attr_of(2, &e.attr);
    fuse_reply_entry(req, &e);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (ino != 2) {
        fuse_reply_err(req, EISDIR);
        return;
    }
    fi->direct_io = 1; /* as ours: every read reaches the server */
    fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t n, off_t off,
                    struct fuse_file_info *fi) {
    (void)ino;
    (void)fi;
    if ((size_t)off >= size)
        n = 0;
    else if (n > size - (size_t)off)
        n = size - (size_t)off;
    fuse_reply_buf(req, data + off, n);
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t n, off_t off,
                     struct fuse_file_info *fi) {
    (void)ino;
    (void)fi;
    if ((size_t)off >= size) {
        fuse_reply_err(req, ENOSPC);
        return;
    }
    if (n > size - (size_t)off)
        n = size - (size_t)off;
    memcpy(data + off, buf, n); /* no range lock: the native ceiling, not a like-for-like */
    fuse_reply_write(req, n);
}

static void op_init(void *userdata, struct fuse_conn_info *conn) {
    (void)userdata;
    conn->max_background = 32 * threads; /* as ours: 32 in flight per serving process */
    conn->congestion_threshold = conn->max_background * 3 / 4;
}

static const struct fuse_lowlevel_ops ops = {
    .init = op_init, .lookup = op_lookup, .getattr = op_getattr, .open = op_open, .read = op_read,
    .write = op_write,
};

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MOUNTPOINT SIZE_MIB THREADS\n", argv[0]);
        return 2;
    }
    size = (size_t)atol(argv[2]) << 20;
    threads = atoi(argv[3]);
    data = calloc(1, size);
    char *fargv[] = {argv[0], NULL};
    struct fuse_args args = FUSE_ARGS_INIT(1, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (!data || !se || fuse_session_mount(se, argv[1]) != 0)
        return 1;
    int rc;
    if (threads <= 1) {
        rc = fuse_session_loop(se);
    } else {
        struct fuse_loop_config *cfg = fuse_loop_cfg_create();
        fuse_loop_cfg_set_clone_fd(cfg, 1);
        fuse_loop_cfg_set_max_threads(cfg, (unsigned)threads);
        fuse_loop_cfg_set_idle_threads(cfg, (unsigned)threads);
        rc = fuse_session_loop_mt(se, cfg);
        fuse_loop_cfg_destroy(cfg);
    }
    fuse_session_unmount(se);
    fuse_session_destroy(se);
    return rc ? 1 : 0;
}
