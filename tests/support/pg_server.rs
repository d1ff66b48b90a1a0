//! A real PostgreSQL server for a test: Debian's `postgresql` binaries, a cluster
//! made by `initdb` in a temporary directory, served by `pg_ctl` on a free loopback
//! port. As root, the server runs as the `postgres` user (it refuses root).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The superuser the cluster is made with; tests connect as it, with no password.
pub const USER: &str = "promptgate";

/// A running server. Stopped (immediately) on drop.
pub struct Postgres {
    pub port: u16,
    bin: PathBuf,
    data: PathBuf,
    as_postgres: bool,
    _dir: super::TempDir,
}

/// The newest installed server's `bin` directory, or why there is none.
pub fn installed() -> Result<PathBuf, String> {
    let mut bins: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("no /usr/lib/postgresql ({e}): install Debian's postgresql"))?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    bins.sort();
    bins.pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| "no initdb under /usr/lib/postgresql/*/bin".into())
}

/// Why a PostgreSQL test cannot run here, as [`super::can_run`] wants it.
pub fn missing() -> Option<String> {
    installed().err()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

impl Postgres {
    /// Makes a cluster and starts it; panics with the server's own words if it cannot.
    pub fn start() -> Postgres {
        Postgres::start_with(None)
    }

    /// A server that speaks TLS with a certificate for 127.0.0.1 signed by `ca`, and
    /// refuses TCP connections without it (`hostnossl … reject`); the test's own
    /// client reaches it over the Unix socket.
    pub fn start_tls(ca: &super::TestCa) -> Postgres {
        Postgres::start_with(Some(ca))
    }

    fn start_with(tls: Option<&super::TestCa>) -> Postgres {
        let bin = installed().expect("PostgreSQL is installed");
        let dir = super::TempDir::new("postgres");
        let data = dir.path().join("data");
        let as_postgres = is_root();
        if as_postgres {
            let chown = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .expect("chown runs");
            assert!(chown.success(), "chown of the cluster directory failed");
        }
        let port = free_port();
        let mut pg = Postgres {
            port,
            bin,
            data,
            as_postgres,
            _dir: dir,
        };
        let data = pg.data.to_str().expect("a UTF-8 temp path").to_owned();
        pg.run(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                USER,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        if let Some(ca) = tls {
            pg.serve_tls(ca);
        }
        pg.start_server();
        pg
    }

    /// Writes the certificate, its key and the settings that turn TLS on.
    fn serve_tls(&self, ca: &super::TestCa) {
        let (cert, key) = ca.leaf_pem(&["127.0.0.1"]);
        for (name, pem) in [("server.crt", cert), ("server.key", key)] {
            let path = self.data.join(name);
            std::fs::write(&path, pem).expect("the data directory is writable");
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .expect("chmod the key");
            if self.as_postgres {
                let chown = Command::new("chown")
                    .args(["postgres:postgres"])
                    .arg(&path)
                    .status()
                    .expect("chown runs");
                assert!(chown.success(), "chown of {name} failed");
            }
        }
        let conf = self.data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str("\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        std::fs::write(&conf, text).expect("postgresql.conf is writable");
        let hba = self.data.join("pg_hba.conf");
        let rest = std::fs::read_to_string(&hba).expect("pg_hba.conf");
        std::fs::write(&hba, format!("hostnossl all all 0.0.0.0/0 reject\n{rest}"))
            .expect("pg_hba.conf is writable");
    }

    /// Starts the server (again) on its port; returns once it accepts connections.
    pub fn start_server(&mut self) {
        let data = self.data.to_str().expect("a UTF-8 temp path").to_owned();
        let log = self.data.with_file_name("server.log");
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off \
             -c full_page_writes=off",
            self.port,
            self.data
                .parent()
                .expect("the cluster has a parent")
                .display()
        );
        self.run(
            "pg_ctl",
            &[
                "-D",
                &data,
                "-o",
                &options,
                "-l",
                log.to_str().expect("a UTF-8 temp path"),
                "-w",
                "-t",
                "30",
                "start",
            ],
        );
    }

    /// Stops the server as an administrator does (`-m fast`): sessions cut, commits kept.
    pub fn stop_server(&self) {
        let data = self.data.to_str().expect("a UTF-8 temp path").to_owned();
        self.run("pg_ctl", &["-D", &data, "-m", "fast", "-w", "stop"]);
    }

    /// Freezes (`SIGSTOP`) or thaws (`SIGCONT`) the server and every backend: a
    /// paused server whose host still acknowledges what is sent to it.
    pub fn signal_all(&self, signal: &str) {
        let pid = std::fs::read_to_string(self.data.join("postmaster.pid"))
            .expect("the server is running");
        let pid = pid.lines().next().expect("a pid line").trim().to_owned();
        for args in [vec![signal, "-P", &pid], vec![signal, &pid]] {
            let sent = Command::new(if args.len() == 3 { "pkill" } else { "kill" })
                .args(&args)
                .status()
                .expect("kill runs");
            assert!(sent.success() || args.len() == 3, "kill {args:?}");
        }
    }

    /// Makes `role` give its password over TCP (the cluster trusts everyone else).
    pub fn require_password_for(&self, role: &str) {
        let hba = self.data.join("pg_hba.conf");
        let rest = std::fs::read_to_string(&hba).expect("pg_hba.conf");
        let first = format!("host all {role} 127.0.0.1/32 scram-sha-256\n");
        std::fs::write(&hba, first + &rest).expect("pg_hba.conf is writable");
        let data = self.data.to_str().expect("a UTF-8 temp path").to_owned();
        self.run("pg_ctl", &["-D", &data, "reload"]);
        // The postmaster reloads on SIGHUP, a moment after pg_ctl returns.
        std::thread::sleep(Duration::from_millis(300));
    }

    /// `postgres://promptgate@127.0.0.1:PORT/db`: no password, as promptgate wants.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{db}", self.port)
    }

    /// A new, empty database.
    pub fn create_db(&self, db: &str) -> String {
        self.execute("postgres", &format!("CREATE DATABASE {db}"));
        self.url(db)
    }

    /// Runs `sql` (statements without results) in database `db`.
    pub fn execute(&self, db: &str, sql: &str) {
        self.with_client(db, |c| c.batch_execute(sql))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// The one integer `sql` selects in database `db`: the test's eyes on the store.
    pub fn count(&self, db: &str, sql: &str) -> i64 {
        self.with_client(db, |c| c.query_one(sql, &[]).map(|r| r.get(0)))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// `f` with a client of `db`, on a thread of its own: the sync client blocks on
    /// a runtime of its own, which an async test's thread cannot do.
    fn with_client<T: Send>(
        &self,
        db: &str,
        f: impl FnOnce(&mut postgres::Client) -> Result<T, postgres::Error> + Send,
    ) -> Result<T, postgres::Error> {
        // Over the Unix socket, which every cluster here trusts (TLS or not).
        let socket = self.data.parent().expect("the cluster has a parent");
        let url = format!(
            "host={} port={} user={USER} dbname={db}",
            socket.display(),
            self.port
        );
        std::thread::scope(|s| {
            s.spawn(|| f(&mut postgres::Client::connect(&url, postgres::NoTls)?))
                .join()
                .expect("the client thread")
        })
    }

    /// One of the server's programs, as the user the cluster belongs to.
    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&program);
            c
        } else {
            Command::new(&program)
        }
    }

    fn run(&self, program: &str, args: &[&str]) -> Output {
        let out = self
            .command(program)
            .args(args)
            .current_dir(self.data.parent().unwrap_or(Path::new("/")))
            .output()
            .unwrap_or_else(|e| panic!("{program} does not run: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?} failed:\n{}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.data.with_file_name("server.log")).unwrap_or_default()
        );
        out
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let data = self.data.to_string_lossy().into_owned();
        let _ = self
            .command("pg_ctl")
            .args(["-D", &data, "-m", "immediate", "stop"])
            .output();
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}
