//! The engine a caller asks for, checked against the one a template was made for.

use cube_supervisor::records::Engine;
use serde::{Deserialize, Serialize};

/// The engine a caller asks for.
///
/// ```
/// use cube_core::{Engine, EngineChoice};
///
/// let choice: EngineChoice = "jail".parse().unwrap();
/// assert!(choice.accepts(Engine::Jail) && !choice.accepts(Engine::Vm));
/// assert!(EngineChoice::Auto.accepts(Engine::Vm));
/// assert!("qemu".parse::<EngineChoice>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineChoice {
    /// Whatever engine the template (or snapshot) was made for.
    #[default]
    Auto,
    /// A KVM microVM; refused for a jail template.
    Vm,
    /// The jail engine; refused for a VM template.
    Jail,
}

impl EngineChoice {
    /// Whether a template of `engine` satisfies this choice.
    pub fn accepts(self, engine: Engine) -> bool {
        matches!(
            (self, engine),
            (EngineChoice::Auto, _)
                | (EngineChoice::Vm, Engine::Vm)
                | (EngineChoice::Jail, Engine::Jail)
        )
    }
}

impl std::fmt::Display for EngineChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            EngineChoice::Auto => "auto",
            EngineChoice::Vm => "vm",
            EngineChoice::Jail => "jail",
        })
    }
}

impl std::str::FromStr for EngineChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(EngineChoice::Auto),
            "vm" => Ok(EngineChoice::Vm),
            "jail" => Ok(EngineChoice::Jail),
            other => Err(format!("unknown engine {other:?} (auto, vm or jail)")),
        }
    }
}
