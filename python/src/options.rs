//! Python values as the core's option types: PJRT create options, sharding requests,
//! precisions (shared by `Runtime` and `Target`).

use crate::errors::ShardingError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat};
use tpuc_compiler::lower::Precision;
use tpuc_passes::sharding::{Mesh, Role, ShardingRequest, Slot, Spec, Strategy};
use tpuc_runtime::OptionValue;

/// A Python value as a PJRT create option's value (bool before int: `True` is an int).
fn option_value(name: &Bound<'_, PyAny>, v: &Bound<'_, PyAny>) -> PyResult<OptionValue> {
    if v.is_instance_of::<PyBool>() {
        return Ok(OptionValue::Bool(v.extract()?));
    }
    if let Ok(i) = v.extract::<i64>() {
        return Ok(OptionValue::Int64(i));
    }
    if v.is_instance_of::<PyFloat>() {
        return Ok(OptionValue::Float(v.extract::<f64>()? as f32));
    }
    if let Ok(s) = v.extract::<String>() {
        return Ok(OptionValue::Str(s));
    }
    if let Ok(list) = v.extract::<Vec<i64>>() {
        return Ok(OptionValue::Int64List(list));
    }
    Err(PyValueError::new_err(format!(
        "tpuc: PJRT create option {name}: expected a bool, int, float, str or list of ints, got {}",
        v.repr()?
    )))
}

/// A `{name: value}` dict of PJRT create options (client or topology) as the runtime takes them.
pub(crate) fn create_options_of(
    d: Option<&Bound<'_, PyDict>>,
) -> PyResult<Vec<(String, OptionValue)>> {
    let Some(d) = d else {
        return Ok(Vec::new());
    };
    d.iter()
        .map(|(k, v)| Ok((k.extract::<String>()?, option_value(&k, &v)?)))
        .collect()
}

/// A sharding request as `Runtime.compile` and `Target.compile` take it (see there).
pub(crate) fn sharding_request(d: &Bound<'_, PyDict>) -> PyResult<ShardingRequest> {
    fn item<'py, X: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<X> {
        d.get_item(key)?
            .ok_or_else(|| PyValueError::new_err(format!("sharding request lacks `{key}`")))?
            .extract()
            .map_err(Into::into)
    }
    let slots = |key: &str| -> PyResult<Vec<Slot>> {
        type RawSlot = (String, String, Option<Vec<Vec<usize>>>);
        let raw: Vec<RawSlot> = item(d, key)?;
        raw.into_iter()
            .map(|(role, name, fixed)| {
                let role = match role.as_str() {
                    "parameter" => Role::Parameter,
                    "buffer" => Role::Buffer,
                    "data" => Role::Data,
                    "other" => Role::Other,
                    r => return Err(PyValueError::new_err(format!("unknown role {r:?}"))),
                };
                Ok(Slot {
                    role,
                    name,
                    fixed: fixed.map(Spec),
                })
            })
            .collect()
    };
    let strategy: String = item(d, "strategy")?;
    let mesh = Mesh::new(item(d, "mesh_shape")?, item(d, "mesh_axes")?)
        .map_err(|e| ShardingError::new_err(format!("tpuc: {e}")))?;
    Ok(ShardingRequest {
        mesh,
        strategy: Strategy::parse(&strategy)
            .ok_or_else(|| PyValueError::new_err(format!("unknown strategy {strategy:?}")))?,
        inputs: slots("inputs")?,
        outputs: slots("outputs")?,
        batch: item(d, "batch")?,
    })
}

/// A precision name (`"highest"`, `"default"` ...) as the lowering takes it.
pub(crate) fn parse_precision(p: &str) -> PyResult<Precision> {
    Precision::parse(p)
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("bad precision {p:?}")))
}
