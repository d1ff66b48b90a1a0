//! A real browser for the web viewer's test: Debian's headless Chromium driven
//! through chromedriver over WebDriver (W3C), so the viewer's HTML, its ES modules
//! and its Content-Security-Policy are exercised by the engine users run, not a mock.
//!
//! The WebDriver calls go through the byte-exact client in [`super::client`]; no
//! WebDriver crate is needed for the handful of commands a test uses.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use super::client;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// The W3C name of an element reference in WebDriver answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// The longest any single WebDriver command may take; page loads and scripts are
/// bounded below this by the session's own timeouts.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a browser test cannot run here (for `support::can_run`), or `None`.
pub fn missing() -> Option<String> {
    [CHROMIUM, CHROMEDRIVER].iter().find_map(|program| {
        (!Path::new(program).exists())
            .then(|| format!("no `{program}` (Debian's chromium and chromium-driver packages)"))
    })
}

/// A headless Chromium session behind its own chromedriver; dropping it ends both.
pub struct Browser {
    driver: Child,
    addr: SocketAddr,
    session: String,
    /// Holds the profile and Chromium's home and temp files; removed on drop.
    dir: PathBuf,
}

impl Browser {
    /// Starts chromedriver on a free loopback port and opens a browser session. Only
    /// loopback hosts (`127.0.0.1`, `localhost`, `[::1]`) resolve in it.
    pub async fn start() -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port for chromedriver")
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!(
            "promptgate-test-browser-{}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let (profile, home, tmp) = (dir.join("profile"), dir.join("home"), dir.join("tmp"));
        for d in [&profile, &home, &tmp] {
            std::fs::create_dir_all(d).expect("create the browser's temp dirs");
        }
        // Chromium writes outside its profile too (crash reports under ~/.config, dconf
        // under ~/.cache, scoped dirs in $TMPDIR): keep all of that in `dir`.
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_CACHE_HOME", home.join(".cache"))
            .env("TMPDIR", &tmp)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {CHROMEDRIVER}: {e}"));
        // From here on, a panic drops this and so cleans up.
        let mut browser = Browser {
            driver,
            addr,
            session: String::new(),
            dir,
        };

        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = browser.driver.try_wait() {
                panic!("chromedriver exited before it was ready ({status})");
            }
            // `client::send` panics when it cannot connect, so see that it can first.
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                let (_, status) = request(addr, "GET", "/status", None).await;
                if status["value"]["ready"] == true {
                    break;
                }
            }
            if tokio::time::Instant::now() > deadline {
                panic!("chromedriver on {addr} was not ready within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        let args = [
            "--headless=new".to_owned(),
            // CI runs as root, where Chromium's sandbox refuses to start.
            "--no-sandbox".to_owned(),
            "--disable-gpu".to_owned(),
            // Containers often have a tiny /dev/shm.
            "--disable-dev-shm-usage".to_owned(),
            "--window-size=1400,900".to_owned(),
            format!("--user-data-dir={}", profile.display()),
            // Chromium must never reach the network. These flags still leave lookups
            // of accounts.google.com and clients2.google.com, so nothing but loopback
            // resolves at all.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1, EXCLUDE [::1]"
                .to_owned(),
            "--no-first-run".to_owned(),
            "--disable-background-networking".to_owned(),
            "--disable-component-update".to_owned(),
            "--disable-sync".to_owned(),
            "--metrics-recording-only".to_owned(),
            "--disable-default-apps".to_owned(),
        ];
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args},
            "goog:loggingPrefs": {"browser": "ALL", "performance": "ALL"},
            "timeouts": {"implicit": 0, "pageLoad": 20_000, "script": 20_000},
        }}});
        let (code, answer) = request(addr, "POST", "/session", Some(&capabilities)).await;
        let Some(session) = answer["value"]["sessionId"].as_str() else {
            panic!("chromedriver could not open a Chromium session ({code}): {answer}");
        };
        browser.session = session.to_owned();
        browser
    }

    /// Navigates to `url` and waits for the page to load.
    pub async fn goto(&self, url: &str) {
        self.command("POST", "/url", json!({ "url": url })).await;
    }

    /// Runs `script` as the body of a function (`return …` gives the value) with
    /// `args` as its `arguments`.
    pub async fn eval(&self, script: &str, args: Vec<Value>) -> Value {
        let body = json!({"script": script, "args": args});
        self.command("POST", "/execute/sync", body).await
    }

    /// Like [`Browser::eval`], but the script finishes by calling its last argument,
    /// the callback, with the value (`arguments[arguments.length - 1](value)`).
    pub async fn eval_async(&self, script: &str, args: Vec<Value>) -> Value {
        let body = json!({"script": script, "args": args});
        self.command("POST", "/execute/async", body).await
    }

    /// Polls the JS `expression` every 50 ms until it is truthy and returns its value;
    /// an expression that throws counts as not yet. Panics after `timeout`, naming
    /// `what`, with the last value and the browser console.
    pub async fn wait_for(&self, what: &str, expression: &str, timeout: Duration) -> Value {
        let script = format!(
            "try {{ return [true, ({expression})]; }} catch (e) {{ return [false, String(e)]; }}"
        );
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let answer = self.eval(&script, vec![]).await;
            let last = if answer[0] == true {
                if truthy(&answer[1]) {
                    return answer[1].clone();
                }
                answer[1].to_string()
            } else {
                format!("threw {}", answer[1])
            };
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}: `{expression}` was {last}\n\
                     browser console:\n{}",
                    self.console().await.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Clicks the first element matching `css`.
    pub async fn click(&self, css: &str) {
        let element = self.element(css).await;
        self.command("POST", &format!("/element/{element}/click"), json!({}))
            .await;
    }

    /// The visible (rendered) text of the first element matching `css`.
    pub async fn text(&self, css: &str) -> String {
        let element = self.element(css).await;
        let text = self
            .command("GET", &format!("/element/{element}/text"), Value::Null)
            .await;
        text.as_str()
            .unwrap_or_else(|| panic!("the text of {css:?} is not a string: {text}"))
            .to_owned()
    }

    /// Types `text` into the first element matching `css` (WebDriver send keys).
    pub async fn type_into(&self, css: &str, text: &str) {
        let element = self.element(css).await;
        let body = json!({ "text": text });
        self.command("POST", &format!("/element/{element}/value"), body)
            .await;
    }

    /// Presses and releases one key on the focused element: a single character
    /// ("j") or a key name (`Enter`, `Escape`, `Tab`, `Backspace`, `ArrowUp`, ...).
    pub async fn press(&self, key: &str) {
        let value = match key {
            "Enter" => "\u{E007}",
            "Escape" => "\u{E00C}",
            "Tab" => "\u{E004}",
            "Backspace" => "\u{E003}",
            "Delete" => "\u{E017}",
            "Home" => "\u{E011}",
            "End" => "\u{E010}",
            "PageUp" => "\u{E00E}",
            "PageDown" => "\u{E00F}",
            "ArrowLeft" => "\u{E012}",
            "ArrowUp" => "\u{E013}",
            "ArrowRight" => "\u{E014}",
            "ArrowDown" => "\u{E015}",
            single if single.chars().count() == 1 => single,
            other => panic!("press({other:?}): not a single character or a known key name"),
        };
        let actions = json!({"actions": [{
            "type": "key",
            "id": "keyboard",
            "actions": [{"type": "keyDown", "value": value}, {"type": "keyUp", "value": value}],
        }]});
        self.command("POST", "/actions", actions).await;
        self.command("DELETE", "/actions", Value::Null).await;
    }

    /// Writes a PNG screenshot of the viewport to `path`.
    pub async fn screenshot(&self, path: &Path) {
        use base64::Engine as _;
        let encoded = self.command("GET", "/screenshot", Value::Null).await;
        let encoded = encoded
            .as_str()
            .unwrap_or_else(|| panic!("the screenshot is not a string: {encoded}"));
        let png = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .expect("the screenshot is base64");
        std::fs::write(path, png)
            .unwrap_or_else(|e| panic!("cannot write the screenshot to {}: {e}", path.display()));
    }

    /// The browser console lines since the last call, as "LEVEL message" (the message
    /// starts with the script's URL and line for `console.*` calls).
    pub async fn console(&self) -> Vec<String> {
        // Chromedriver's log extension under its W3C-mode prefix (`/se/log/types` says
        // "browser" and "driver"); it hands out each entry once.
        let entries = self
            .command("POST", "/se/log", json!({"type": "browser"}))
            .await;
        let entries = entries
            .as_array()
            .unwrap_or_else(|| panic!("the browser log is not a list: {entries}"));
        entries
            .iter()
            .map(|e| {
                let level = e["level"].as_str().unwrap_or("?");
                let message = e["message"].as_str().unwrap_or_default();
                format!("{level} {message}")
            })
            .collect()
    }

    /// The HTTP responses the browser received since the last call, as (URL, status),
    /// from Chromium's network log: what the server answered, even where the page
    /// itself may not read it (a cross-origin answer without CORS headers).
    pub async fn responses(&self) -> Vec<(String, u16)> {
        let entries = self
            .command("POST", "/se/log", json!({"type": "performance"}))
            .await;
        let entries = entries
            .as_array()
            .unwrap_or_else(|| panic!("the performance log is not a list: {entries}"));
        // A response the page may not read (CORS) is only in the raw `ExtraInfo`
        // event, which names the request by id: its URL comes from the request.
        let mut urls = std::collections::HashMap::new();
        let mut out = Vec::new();
        for e in entries {
            let Some(m) = e["message"]
                .as_str()
                .and_then(|m| serde_json::from_str::<Value>(m).ok())
            else {
                continue;
            };
            let (method, params) = (&m["message"]["method"], &m["message"]["params"]);
            let id = params["requestId"].as_str().unwrap_or_default().to_owned();
            if method == "Network.requestWillBeSent" {
                if let Some(url) = params["request"]["url"].as_str() {
                    urls.insert(id, url.to_owned());
                }
            } else if method == "Network.responseReceivedExtraInfo"
                && let Some(status) = params["statusCode"].as_u64()
            {
                out.push((id, u16::try_from(status).unwrap_or(0)));
            }
        }
        out.into_iter()
            .map(|(id, status)| (urls.get(&id).cloned().unwrap_or(id), status))
            .collect()
    }

    /// The WebDriver reference of the first element matching `css`.
    async fn element(&self, css: &str) -> String {
        let body = json!({"using": "css selector", "value": css});
        let found = self.command("POST", "/element", body).await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element reference for {css:?}: {found}"))
            .to_owned()
    }

    /// A command in the session; its `value`, or a panic naming the WebDriver error.
    async fn command(&self, method: &str, path: &str, body: Value) -> Value {
        let target = format!("/session/{}{path}", self.session);
        let body = (!body.is_null()).then_some(body);
        let (code, mut answer) = request(self.addr, method, &target, body.as_ref()).await;
        let value = answer["value"].take();
        if code != 200 {
            let error = value["error"].as_str().unwrap_or("?");
            let message = value["message"].as_str().unwrap_or_default();
            let request = body.map(|b| b.to_string()).unwrap_or_default();
            panic!("WebDriver {method} {path} {request} failed ({code} {error}): {message}");
        }
        value
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Synchronously, as Drop cannot await. Ending the session quits Chromium.
        let connected = if self.session.is_empty() {
            None
        } else {
            std::net::TcpStream::connect_timeout(&self.addr, Duration::from_secs(2)).ok()
        };
        if let Some(mut stream) = connected {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
            let request = format!(
                "DELETE /session/{} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                self.session, self.addr
            );
            if stream.write_all(request.as_bytes()).is_ok() {
                // The answer comes once Chromium has quit.
                let _ = stream.read(&mut [0; 1024]);
            }
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        // Chromium outlives a killed chromedriver, so if the session did not end it,
        // kill it and its helpers here; and wait for them all, lest one write into
        // `dir` after it is removed.
        for _ in 0..100 {
            let left = processes_naming(&self.dir);
            if left.is_empty() {
                break;
            }
            let _ = Command::new("kill").arg("-KILL").args(&left).status();
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends one WebDriver request; returns the status and the JSON answer.
async fn request(
    addr: SocketAddr,
    method: &str,
    target: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut headers = vec![("Host", addr.to_string())];
    let body = match body {
        Some(body) => {
            headers.push(("Content-Type", "application/json".to_owned()));
            body.to_string().into_bytes()
        }
        None => Vec::new(),
    };
    let bytes = client::request_bytes(method, target, &headers, &body);
    let response = tokio::time::timeout(COMMAND_TIMEOUT, client::send(addr, &bytes))
        .await
        .unwrap_or_else(|_| {
            panic!("WebDriver {method} {target}: no answer within {COMMAND_TIMEOUT:?}")
        });
    (response.status, response.json())
}

/// The live processes whose command line names a path under `dir`: Chromium and all
/// its helpers carry the profile or the home directory in theirs.
fn processes_naming(dir: &Path) -> Vec<String> {
    let needle = format!("{}/", dir.display());
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmdline).contains(&needle)
        })
        .collect()
}

/// JavaScript truthiness of a value that came back through WebDriver.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(_) | Value::Object(_) => true,
    }
}
