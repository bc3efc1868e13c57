//! File operations relative to a directory fd that never follow a link.
//!
//! The server runs as root and the agent owns every directory under its workspace, so any
//! path-based call could be redirected by a link the agent planted. Everything here works
//! from an open directory fd: lookups refuse links at every component (`openat2` with
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS` where the kernel has it,
//! else a walk of `openat(O_NOFOLLOW | O_DIRECTORY)`), files are opened non-blocking and
//! checked to be regular after opening, reads are capped, and writes go through a fresh
//! randomly named file created with `O_EXCL | O_NOFOLLOW`, changed through its fd and
//! renamed within the same directory fd.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Component, Path};
use std::sync::OnceLock;

use serde::Serialize;

/// How paths are resolved beneath a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Resolver {
    /// One `openat2` call with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`
    /// (Linux 5.6+).
    Openat2,
    /// A walk of `openat(O_NOFOLLOW | O_DIRECTORY)`, one component at a time.
    Walk,
}

impl Resolver {
    /// The best resolver this kernel offers, probed once.
    pub fn detect() -> Self {
        static DETECTED: OnceLock<Resolver> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let probe = openat2(libc::AT_FDCWD, c"/", libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC, 0);
            match probe {
                Ok(_) => Resolver::Openat2,
                Err(e) => {
                    // ENOSYS on old kernels, EPERM under a container's filter: walk instead.
                    tracing::info!(error = %e, "openat2 unavailable; resolving paths component by component");
                    Resolver::Walk
                }
            }
        })
    }
}

/// What kind of file a directory entry is (never following a link).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    Device,
    Other,
}

impl Kind {
    pub(crate) fn of_mode(mode: libc::mode_t) -> Self {
        match mode & libc::S_IFMT {
            libc::S_IFREG => Kind::Regular,
            libc::S_IFDIR => Kind::Directory,
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFIFO => Kind::Fifo,
            libc::S_IFSOCK => Kind::Socket,
            libc::S_IFCHR | libc::S_IFBLK => Kind::Device,
            _ => Kind::Other,
        }
    }

    /// The kind in words, for messages.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Kind::Regular => "a regular file",
            Kind::Directory => "a directory",
            Kind::Symlink => "a symbolic link",
            Kind::Fifo => "a FIFO",
            Kind::Socket => "a socket",
            Kind::Device => "a device",
            Kind::Other => "not a regular file",
        }
    }
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cstr(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains a NUL byte"))
}

fn openat2(dir: RawFd, path: &CStr, flags: libc::c_int, resolve: u64) -> io::Result<OwnedFd> {
    // SAFETY: `open_how` is plain data; zero is a valid value for every field.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u64;
    how.resolve = resolve;
    loop {
        // SAFETY: valid fd/path pointers and the exact size of `how`.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir,
                path.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if ret >= 0 {
            // SAFETY: the kernel handed us a new fd that nothing else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) });
        }
        let err = io::Error::last_os_error();
        // EAGAIN: a rename raced the lookup under RESOLVE_BENEATH; try again.
        if err.raw_os_error() != Some(libc::EAGAIN) && err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

fn openat(dir: RawFd, name: &CStr, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    // SAFETY: valid fd and C string; the returned fd is owned by the caller.
    let fd = cvt(unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    })?;
    // SAFETY: a fresh fd from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fstatat` without following a final link; `None` when the name does not exist.
pub(crate) fn stat_at(dir: &OwnedFd, name: &CStr) -> io::Result<Option<libc::stat>> {
    // SAFETY: `stat` is plain data, filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, C string and out pointer.
    let ret = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if ret == 0 {
        return Ok(Some(st));
    }
    let err = io::Error::last_os_error();
    if err.kind() == io::ErrorKind::NotFound {
        Ok(None)
    } else {
        Err(err)
    }
}

/// `fstat` of an open fd.
pub(crate) fn fstat(fd: &impl AsRawFd) -> io::Result<libc::stat> {
    // SAFETY: plain data, filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

/// The normal components of a relative path that has been normalised (no `.`, `..`, root).
fn components(rel: &Path) -> io::Result<Vec<&OsStr>> {
    rel.components()
        .map(|c| match c {
            Component::Normal(n) => Ok(n),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "path is not normalised",
            )),
        })
        .collect()
}

/// Opens `rel` beneath `dir` with `flags`, following no link at any component. An empty
/// `rel` opens `dir` itself again.
pub(crate) fn open_beneath(
    resolver: Resolver,
    dir: &OwnedFd,
    rel: &Path,
    flags: libc::c_int,
) -> io::Result<OwnedFd> {
    let parts = components(rel)?;
    let flags = flags | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    let Some((last, parents)) = parts.split_last() else {
        return openat(dir.as_raw_fd(), c".", flags & !libc::O_NOFOLLOW, 0);
    };
    match resolver {
        Resolver::Openat2 => {
            let path = cstr(rel.as_os_str())?;
            let resolve =
                libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
            openat2(dir.as_raw_fd(), &path, flags, resolve)
        }
        Resolver::Walk => {
            let mut cur: Option<OwnedFd> = None;
            for part in parents {
                let at = cur.as_ref().unwrap_or(dir).as_raw_fd();
                cur = Some(openat(
                    at,
                    &cstr(part)?,
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                    0,
                )?);
            }
            let at = cur.as_ref().unwrap_or(dir).as_raw_fd();
            openat(at, &cstr(last)?, flags, 0)
        }
    }
}

/// Opens the directory `rel` beneath `dir`.
pub(crate) fn open_dir(resolver: Resolver, dir: &OwnedFd, rel: &Path) -> io::Result<OwnedFd> {
    open_beneath(resolver, dir, rel, libc::O_RDONLY | libc::O_DIRECTORY)
}

/// Opens (creating what is missing) the directory `rel` beneath `dir`, one component at a
/// time. New directories get mode 0755 and `owner`. With `displace`, a non-directory in the
/// way (a link, a file, a FIFO) is moved aside first, as the restore of protected files
/// needs; without it, it is an error.
pub(crate) fn make_dirs(
    dir: &OwnedFd,
    rel: &Path,
    owner: Option<(u32, u32)>,
    displace: bool,
) -> io::Result<OwnedFd> {
    let mut cur = openat(dir.as_raw_fd(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    for part in components(rel)? {
        let name = cstr(part)?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
        let next = match openat(cur.as_raw_fd(), &name, flags, 0) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                mkdir_owned(&cur, &name, owner)?;
                openat(cur.as_raw_fd(), &name, flags, 0)?
            }
            Err(e) if displace && matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                move_aside(&cur, &name)?;
                mkdir_owned(&cur, &name, owner)?;
                openat(cur.as_raw_fd(), &name, flags, 0)?
            }
            Err(e) => return Err(e),
        };
        cur = next;
    }
    Ok(cur)
}

fn mkdir_owned(dir: &OwnedFd, name: &CStr, owner: Option<(u32, u32)>) -> io::Result<()> {
    // SAFETY: valid fd and C string.
    match cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o755) }) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(e),
    }
    if let Some((uid, gid)) = owner {
        // Through an fd opened without following links: if the new directory was swapped for
        // a link in between, the open fails and nothing is chowned.
        let fd = openat(
            dir.as_raw_fd(),
            name,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
        )?;
        // SAFETY: valid fd.
        cvt(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) })?;
    }
    Ok(())
}

/// Renames `name` to a fresh hidden name in the same directory; returns the new name.
pub(crate) fn move_aside(dir: &OwnedFd, name: &CStr) -> io::Result<String> {
    let shown: String = String::from_utf8_lossy(name.to_bytes())
        .chars()
        .take(64)
        .collect();
    let aside = format!(".{shown}.displaced-{}", random_hex()?);
    let aside_c = cstr(OsStr::new(&aside))?;
    // SAFETY: valid fds and C strings.
    cvt(unsafe {
        libc::renameat(
            dir.as_raw_fd(),
            name.as_ptr(),
            dir.as_raw_fd(),
            aside_c.as_ptr(),
        )
    })?;
    Ok(aside)
}

/// 128 random bits in hex, from the kernel's generator.
fn random_hex() -> io::Result<String> {
    let mut buf = [0u8; 16];
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: writes at most the remaining length into `buf`.
        let n =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n > 0 {
            filled += n as usize;
        } else {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) {
                return Err(err);
            }
        }
    }
    Ok(hex::encode(buf))
}

/// What an open of an existing regular file found instead.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// No such file.
    Missing,
    /// The entry (or a component on the way) is a link.
    Link,
    /// The entry exists but is not a regular file.
    NotRegular(Kind),
    /// Any other failure.
    Io(io::Error),
}

impl From<io::Error> for OpenError {
    fn from(e: io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOENT) => OpenError::Missing,
            Some(libc::ELOOP) => OpenError::Link,
            Some(libc::ENXIO) => OpenError::NotRegular(Kind::Socket),
            Some(libc::EISDIR) => OpenError::NotRegular(Kind::Directory),
            _ => OpenError::Io(e),
        }
    }
}

/// Opens `rel` beneath `dir` for reading, only if it is a regular file. Non-blocking, so a
/// FIFO answers at once, and checked after opening, so a swap in between is caught.
pub(crate) fn open_regular(
    resolver: Resolver,
    dir: &OwnedFd,
    rel: &Path,
) -> Result<(File, libc::stat), OpenError> {
    let fd = open_beneath(
        resolver,
        dir,
        rel,
        libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY,
    )?;
    let st = fstat(&fd)?;
    match Kind::of_mode(st.st_mode) {
        Kind::Regular => Ok((File::from(fd), st)),
        other => Err(OpenError::NotRegular(other)),
    }
}

/// The first bytes of a file, at most `cap`.
#[derive(Debug)]
pub(crate) struct Capped {
    /// The bytes read.
    pub bytes: Vec<u8>,
    /// The file's size when opened.
    pub size: u64,
    /// The file holds more than was read.
    pub truncated: bool,
}

/// Reads at most `cap` bytes of an open regular file.
pub(crate) fn read_capped(file: &mut File, size: u64, cap: u64) -> io::Result<Capped> {
    let mut bytes = Vec::with_capacity(size.min(cap) as usize);
    // One byte past the cap tells a file that grew since the fstat from one that fits.
    Read::by_ref(file)
        .take(cap.saturating_add(1))
        .read_to_end(&mut bytes)?;
    let truncated = bytes.len() as u64 > cap;
    bytes.truncate(cap as usize);
    Ok(Capped {
        bytes,
        size,
        truncated,
    })
}

/// Writes `contents` as `name` in `dir` atomically: a fresh file under an unpredictable
/// name, created exclusively without following links, given `owner` and `mode` through its
/// fd, then renamed over `name` within the same directory. The rename replaces whatever
/// entry `name` is (a link is replaced, never followed).
pub(crate) fn write_replace(
    dir: &OwnedFd,
    name: &CStr,
    contents: &[u8],
    mode: u32,
    owner: Option<(u32, u32)>,
) -> io::Result<()> {
    let (tmp, fd) = create_temp(dir)?;
    let result = (|| {
        let mut file = File::from(fd);
        file.write_all(contents)?;
        if let Some((uid, gid)) = owner {
            // SAFETY: valid fd.
            cvt(unsafe { libc::fchown(file.as_raw_fd(), uid, gid) })?;
        }
        // After the chown, which clears set-id bits; and never more than rwx for anyone.
        // SAFETY: valid fd.
        cvt(unsafe { libc::fchmod(file.as_raw_fd(), (mode & 0o777) as libc::mode_t) })?;
        // No fsync: a workspace does not outlive a server restart (the episode is
        // truncated), and the rename alone keeps readers from seeing a half-written file.
        drop(file);
        // SAFETY: valid fds and C strings.
        cvt(unsafe {
            libc::renameat(
                dir.as_raw_fd(),
                tmp.as_ptr(),
                dir.as_raw_fd(),
                name.as_ptr(),
            )
        })?;
        Ok(())
    })();
    if result.is_err() {
        // SAFETY: valid fd and C string; removes only the entry we created.
        unsafe { libc::unlinkat(dir.as_raw_fd(), tmp.as_ptr(), 0) };
    }
    result
}

fn create_temp(dir: &OwnedFd) -> io::Result<(CString, OwnedFd)> {
    let mut last = None;
    for _ in 0..8 {
        let name = cstr(OsStr::new(&format!(".cuda-agent-{}.tmp", random_hex()?)))?;
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        match openat(dir.as_raw_fd(), &name, flags, 0o600) {
            Ok(fd) => return Ok((name, fd)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no free temporary name")))
}

/// One entry of a directory listing.
#[derive(Debug)]
pub(crate) struct Entry {
    pub name: OsString,
    pub kind: Kind,
}

/// The entries of an open directory (not `.` and `..`), at most `max`; the flag says the
/// listing stopped at `max`. Kinds come from `d_type`, or `fstatat` where the filesystem
/// does not say.
pub(crate) fn list_dir(dir: &OwnedFd, max: usize) -> io::Result<(Vec<Entry>, bool)> {
    // fdopendir takes ownership of the fd it is given, so give it a duplicate.
    // SAFETY: valid fd.
    let dup = cvt(unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
    // SAFETY: a fresh fd we own; on failure we close it ourselves.
    let stream = unsafe { libc::fdopendir(dup) };
    if stream.is_null() {
        let err = io::Error::last_os_error();
        // SAFETY: the fd is still ours when fdopendir fails.
        unsafe { libc::close(dup) };
        return Err(err);
    }
    // The duplicate shares its offset with `dir`: start from the beginning.
    // SAFETY: a valid stream.
    unsafe { libc::rewinddir(stream) };
    let mut entries = Vec::new();
    let mut stopped = false;
    let result = loop {
        // readdir signals errors through errno only.
        // SAFETY: errno location is thread-local.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: a valid stream; the entry is read before the next call.
        let ent = unsafe { libc::readdir(stream) };
        if ent.is_null() {
            let errno = io::Error::last_os_error();
            break if errno.raw_os_error() == Some(0) {
                Ok(())
            } else {
                Err(errno)
            };
        }
        // SAFETY: readdir returned a valid entry with a NUL-terminated name.
        let (name, d_type) = unsafe {
            (
                CStr::from_ptr((*ent).d_name.as_ptr()).to_bytes().to_vec(),
                (*ent).d_type,
            )
        };
        if name == b"." || name == b".." {
            continue;
        }
        if entries.len() >= max {
            stopped = true;
            break Ok(());
        }
        let kind = match d_type {
            libc::DT_REG => Kind::Regular,
            libc::DT_DIR => Kind::Directory,
            libc::DT_LNK => Kind::Symlink,
            libc::DT_FIFO => Kind::Fifo,
            libc::DT_SOCK => Kind::Socket,
            libc::DT_CHR | libc::DT_BLK => Kind::Device,
            _ => {
                // A directory entry's name holds no NUL; were one there, the kind is unknown.
                match CString::new(name.clone()).map(|c| stat_at(dir, &c)) {
                    Ok(Ok(Some(st))) => Kind::of_mode(st.st_mode),
                    _ => Kind::Other,
                }
            }
        };
        entries.push(Entry {
            name: OsString::from_vec(name),
            kind,
        });
    };
    // SAFETY: closes the stream and its duplicate fd.
    unsafe { libc::closedir(stream) };
    result.map(|()| (entries, stopped))
}

/// Reads a small state file the server keeps where the agent can write (the Bash working
/// directory record): only a regular file, never through a link, non-blocking, at most
/// `max` bytes. `None` when it is missing or anything else is off.
pub fn read_state_file(path: &Path, max: u64) -> Option<String> {
    let c = cstr(path.as_os_str()).ok()?;
    let flags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY;
    let fd = openat(libc::AT_FDCWD, &c, flags, 0).ok()?;
    let st = fstat(&fd).ok()?;
    if Kind::of_mode(st.st_mode) != Kind::Regular || st.st_size as u64 > max {
        return None;
    }
    let capped = read_capped(&mut File::from(fd), st.st_size as u64, max).ok()?;
    if capped.truncated {
        return None;
    }
    String::from_utf8(capped.bytes).ok()
}
